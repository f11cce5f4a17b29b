"""The analysis tier: Spark streaming jobs over JetStream streams (imports runtime only).

A job is data (`specs.JobSpec`, fields named by JSON path: `paths`), planned per kind
(`plans`: top-N, distinct, count, sample, custom; the events and windows they read in
`event_time`, their sketches kept in Spark state in `sketch_state`, the summaries themselves
in `sketches`), and run (`running`) from the ``jetstream`` source (`jetstream`, with
`jetstream_options` and `jetstream_read`) to the idempotent `sink`. `driver` is the
supervised Ray actor that hosts Spark and keeps the wanted jobs running; `windows` holds the
window operators for custom jobs and the late-event counter.
"""
