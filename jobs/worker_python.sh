#!/bin/sh
# The Python that Spark starts for the jetstream source's workers (jobs/jetstream.py):
# the interpreter in $TIERFLOW_WORKER_PYTHON, with the entries listed in
# $TIERFLOW_WORKER_DROP_PATH (colon-separated, exact) taken out of PYTHONPATH.
#
# Spark puts $SPARK_HOME/python/lib/pyspark.zip first on a worker's PYTHONPATH; Python
# compiles every module it imports from a zip again in every new process (no bytecode
# cache), which is most of a Python source's start. The source lists the zips only when
# this interpreter has the same pyspark (and py4j) installed, so the worker imports those,
# with their cached bytecode; every other PYTHONPATH entry stays, in its order.
#
# With $TIERFLOW_SOURCE_ZYGOTE naming a listening socket, a query's source runner is forked
# from that zygote instead (see below).
set -f
keep=""
rest="$PYTHONPATH"
while [ -n "$rest" ]; do
    entry="${rest%%:*}"
    case "$rest" in
        *:*) rest="${rest#*:}" ;;
        *) rest="" ;;
    esac
    case ":$TIERFLOW_WORKER_DROP_PATH:" in
        *":$entry:"*) ;;
        *) keep="${keep:+$keep:}$entry" ;;
    esac
done
PYTHONPATH="$keep"
export PYTHONPATH
# A query's source runner, with a source zygote listening: forked from the zygote, which
# has its imports done (jobs/source_zygote.py), through a client that starts in milliseconds.
if [ "$1" = "-m" ] && [ "$2" = "pyspark.sql.streaming.python_streaming_source_runner" ] \
    && [ -n "$TIERFLOW_SOURCE_ZYGOTE" ] && [ -S "$TIERFLOW_SOURCE_ZYGOTE" ]; then
    exec "${TIERFLOW_WORKER_PYTHON:-python3}" -S -E "${0%/*}/zygote_client.py" "$@"
fi
exec "${TIERFLOW_WORKER_PYTHON:-python3}" "$@"
