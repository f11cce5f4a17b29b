"""Supervision and scaling: the OTP-style policy (`policy`), its runners for pykka actors in
one process (`local`) and for Ray actors (`ray_actors`), and the autoscaling policy
(`autoscaling`). The policies are pure; the runners do the I/O."""
