"""``python -m swan_dist``: the environment report to paste into a bug report (:mod:`swan_dist.environment`)."""

from swan_dist.environment import main

main()
