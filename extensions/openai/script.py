"""The openai extension's TGW entry: `--api` (or `--extensions openai`) loads it, and
setup() starts the server in a background thread.

Flags read from serving.shared.args (TGW's names): --listen, --listen-host, --api-port,
--api-key, --admin-key, --api-cors-origins. Settings keys "openai-host"/"openai-port"
override the params below.
"""

from extensions.openai.server import ApiServer, run_api_server
from serving import shared

params = {
    "display_name": "OpenAI API",
    "is_tab": False,
    "host": "127.0.0.1",
    "port": 5000,
}

server: ApiServer | None = None


def _arg(name, default=None):
    value = getattr(shared.args, name, None)
    return default if value is None else value


def setup():
    global server
    if server is not None:
        return
    host = params["host"]
    if _arg("listen", False):
        host = _arg("listen_host", "0.0.0.0")
    origins = _arg("api_cors_origins", "") or ""
    if isinstance(origins, str):
        origins = [o.strip() for o in origins.split(",") if o.strip()]
    server = run_api_server(
        host,
        int(_arg("api_port", params["port"])),
        _arg("api_key"),
        _arg("admin_key"),
        block=False,
        cors_origins=origins,
    )
