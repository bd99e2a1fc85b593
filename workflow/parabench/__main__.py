from parabench.cli import main

raise SystemExit(main())
