"""TGW's `modules.logging_colors.logger`."""

import logging

logger = logging.getLogger("text-generation-webui")
