# minGPT's own mingpt/__init__.py is empty. The vendored files import each other as the top-level
# package ``mingpt`` (``from mingpt.utils import CfgNode as CN``); alias this package and its
# modules under those names so the files import unchanged (and each is loaded once).
import sys as _sys

_sys.modules.setdefault("mingpt", _sys.modules[__name__])
from . import utils as _utils  # noqa: E402

_sys.modules.setdefault("mingpt.utils", _utils)
from . import model as _model  # noqa: E402

_sys.modules.setdefault("mingpt.model", _model)
from . import trainer as _trainer  # noqa: E402

_sys.modules.setdefault("mingpt.trainer", _trainer)
