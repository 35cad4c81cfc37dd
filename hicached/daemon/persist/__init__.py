"""Keeping L2 over restarts, crashes and takeovers, and the warm list: `keep` (the index snapshot and the
restore of a kept pool), `headers` (the slot headers a crash rebuilds L2 from), `kept` (the pools taken back
from systemd's fd store or a takeover at start, and handed to it), `takeover` (a new instance taking over
from a running one), `warmup` (the warm list and the refill of L2 after a cold start) and `warmlist` (the
warm list's life in a running daemon). Above the scheduler: L2 and the scheduler never import it, and hear
of it only through the callbacks the daemon hands them when it builds them."""
