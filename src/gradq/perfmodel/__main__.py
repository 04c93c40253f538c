"""``python -m gradq.perfmodel …``: the ``gradq perfmodel`` command on its own."""

from .cli import main

raise SystemExit(main())
