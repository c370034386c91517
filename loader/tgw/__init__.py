"""Kestrel as a loader for text-generation-webui (TGW).

    python -m loader.tgw install PATH_TO_TGW [--dry-run]
    python -m loader.tgw uninstall PATH_TO_TGW [--dry-run]
    python -m loader.tgw status PATH_TO_TGW

state.py maps TGW's flags and generation state to Kestrel's; model.py is the model class
TGW drives (KestrelTGWModel); glue.py is what the hooks in TGW call; edits.py and
installer.py put those hooks into a TGW tree and take them out again.
"""
