"""The daemon's Unix-socket server: the listener binds the socket, admits peers by uid/gid, hands them the
pool's fd and passes a region's memfd; each admitted peer gets a connection that reads requests, runs
their handlers and writes the answers."""
