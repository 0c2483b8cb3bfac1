from .tools.demo import main

raise SystemExit(main())
