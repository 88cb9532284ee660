from stepstream.cli import main

raise SystemExit(main())
