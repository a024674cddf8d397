from eldr.cli import main

raise SystemExit(main())
