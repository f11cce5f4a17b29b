"""``python -m cluster.cli``: how `tierflow up --detach` starts its daemon."""

from cluster.cli import main

main()
