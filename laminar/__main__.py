from laminar.cli import main

raise SystemExit(main())
