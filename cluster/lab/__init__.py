"""The multi-host lab: hosts made of Linux network namespaces on one machine, each with its
own address on a private bridge, for running tierflow as on a cluster and cutting the
network between its hosts (docs/chaos.md, "The lab").

- `plan`: the lab's names, addresses and the `ip` commands that make and unmake it (pure).
- `hosts`: `Lab`, which runs those commands, starts processes inside a host and records
  them, and cleans up what a killed run left behind.
- `nemesis`: the network and process faults, applied to a `Lab`.
"""
