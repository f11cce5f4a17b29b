"""Fault injection for tierflow: schedules, injectors, the scenario runner and its report.

`tierflow chaos run --scenario NAME|all` (cluster.cli.chaos) deploys the pipeline, drives a
load with known ids, applies a seeded schedule of faults and verifies that nothing
acknowledged was lost or duplicated. `proxy` holds the TCP fault proxy.
"""
