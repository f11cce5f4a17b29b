"""Spark's launch of a jetstream source runner, handed to the source zygote
(jobs/source_zygote.py): run by jobs/worker_python.sh as ``python -S -E <this file> -m
<runner module>``, so it imports nothing but the standard library's core (a few
milliseconds). It sends its arguments, environment, working directory and standard streams
to the zygote and exits with the forked runner's status; if the zygote cannot be reached it
becomes the interpreter Spark asked for (``exec``), with the same arguments and environment.
"""

import json
import os
import socket
import struct
import sys

ZYGOTE_ENV = "TIERFLOW_SOURCE_ZYGOTE"
PYTHON_ENV = "TIERFLOW_WORKER_PYTHON"


def main() -> None:
    args = sys.argv[1:]
    request = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(os.environ[ZYGOTE_ENV])
        socket.send_fds(conn, [request], [0, 1, 2])
    except (OSError, KeyError):
        conn.close()
        python = os.environ.get(PYTHON_ENV) or sys.executable
        os.execv(python, [python, *args])
    status = conn.recv(4)
    if len(status) < 4:  # the zygote went away with the runner
        sys.exit(1)
    code = struct.unpack("!i", status)[0]
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
