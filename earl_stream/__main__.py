from earl_stream.cli import main

raise SystemExit(main())
