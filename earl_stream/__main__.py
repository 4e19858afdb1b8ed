from earl_stream.cli.main import main

raise SystemExit(main())
