"""The daemon as a service: its lifecycle (build the parts from a config, start them in order, stop them
in reverse, and the operator's levers: reload, backend attach/detach, drain, flush), the systemd notify
protocol and socket activation, and the Prometheus metrics listener."""
