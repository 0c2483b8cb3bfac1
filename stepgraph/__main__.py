from .demo import main

raise SystemExit(main())
