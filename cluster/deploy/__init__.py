"""Deploying the roles on Ray: every role declared as data and started through one place.

The design, in three layers:

1. **A role is data.** `spec.RoleSpec` is to a role what `runtime.supervision.policy.ChildSpec`
   is to one actor: the role's name, its replicas' `ChildSpec`s in start order (ids are
   the actors' names, ``<role>-<i>``), how they start (`spec.Start`), the supervisor that
   watches them (`spec.SupervisorSpec`: name, strategy, restart intensity) and the method
   that answers once a replica serves (`ready`).

   =========  ===============  =========================  =================  =========
   role       module           start                      supervisor         ready
   =========  ===============  =========================  =================  =========
   logger     `logger`         REPLICA_GROUPS (k+1 each)  (epoch fencing)    catch-up
   bridge     `collection`     SUPERVISED                 ``collection``     ``ready``
   collector  `collection`     SUPERVISED                 ``collection``     endpoints
   ingest     `stream_ingest`  DETACHED (k+1, SPREAD)     (Ray restarts)     -
   gateway    `gateway`        SUPERVISED                 ``gateways``       endpoints
   analysis   `analysis`       DETACHED                   (Ray restarts)     -
   root       `launcher`       SUPERVISED, no children    ``tierflow-root``  -
   =========  ===============  =========================  =================  =========

2. **One pure function per role builds it** from the Config and what the role is wired
   to (a port chosen up front, the logger groups' clients, the bridges' names):
   `logger.logger_role`, `collection.bridge_role` / `collector_role`,
   `stream_ingest.ingest_role`, `gateway.gateway_role`, `analysis.analysis_role`,
   `cluster.launcher.root_role`. They start nothing, so a test reads a role's whole
   configuration without Ray. Per replica, `collection.bridge_child` / `collector_child`,
   `gateway.gateway_spec` and `logger.logger_group_child` build one `ChildSpec`: the same
   functions serve the first start and every later replica.

3. **One path starts, resizes and stops them**: `deployer`.

   - `deploy(specs)`: places each SUPERVISED role's children one per node while nodes
     last (`runtime.state.placement.plan`, a hint the supervisor turns into a hard affinity),
     starts each supervisor once with all the children of the roles that share it,
     starts DETACHED actors (named, detached, restarted by Ray) and replica groups
     (`logger.start_group`: k+1 copies on distinct nodes, the empty ones caught up), then
     waits until every replica's `ready` method answers.
   - `add_replica` / `remove_replica`: one more replica under the role's supervisor on
     the node with the fewest of its siblings, serving before it counts; one fewer,
     drained first (``shutdown``: stop taking work, finish what is in hand).
   - `drain`, `stop_supervisor`: close replicas cleanly (each role's own method:
     ``shutdown``, ``stop``), then stop the supervisor and its children for good.

   Resizing a running pipeline enters at `cluster.launcher.Runtime.scale(role, n)` (the
   admin endpoint's ``/scale`` and the autoscaler both call it), which hands gateways to
   `gateway.scale_gateways` and the collection roles to `cluster.pipeline.CollectionTier`,
   whose only addition is the order the wiring needs (a collector names its logger group
   and the bridges at construction, so resizing loggers or bridges rolls the collectors).
   Both go through `add_replica`, `remove_replica` and `deploy`.

This layer changes no actor behaviour, actor or supervisor name, or port: it only declares
the roles as data and starts, resizes and stops them through one path. (One exception: a
port tierflow chose for a role, found taken by another process when the replicas bind it,
is chosen again and the role started again: `deployer.deploy_on_port`.) The role modules
keep their ``start_*`` / ``stop_*`` / ``scale_*`` helpers (tests and tools use them): each
start hands a `RoleSpec` to `deploy`, each resize and stop goes through the `deployer`
functions above.
"""
