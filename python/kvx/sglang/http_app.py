"""SGLang's HTTP app for its TokenizerWorker processes (``--tokenizer-worker-num`` > 1).

Those processes are uvicorn workers that import the app by its path and resolve the transfer
backend without loading SGLang's plugins, so ``TransferBackend("kvx")`` would be refused there.
This module loads the plugins first, then is SGLang's own app; ``install()`` makes it the app path
(``SGLANG_HTTP_SERVER_APP_PATH``) unless the operator chose another."""

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.entrypoints.http_server import app  # noqa: E402

__all__ = ["app"]
