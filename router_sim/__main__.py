"""``python -m router_sim`` is ``router-sim``."""

from router_sim.cli import main

raise SystemExit(main())
