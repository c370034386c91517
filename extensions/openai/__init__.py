"""Kestrel's OpenAI-compatible API, as a TGW-style extension (script.py) and a library.

from extensions.openai import create_app, run_api_server
"""

from extensions.openai.app import create_app
from extensions.openai.server import ApiServer, ApiServerError, run_api_server

__all__ = ["ApiServer", "ApiServerError", "create_app", "run_api_server"]
