"""Kestrel as a loader for text-generation-webui (TGW).

    kestrel-tgw install PATH_TO_TGW [--dry-run]      (or: python -m loader.tgw ...)
    kestrel-tgw uninstall PATH_TO_TGW [--dry-run]
    kestrel-tgw status PATH_TO_TGW

names.py holds the names TGW and Kestrel share (loader name, controls, cache types);
state.py maps TGW's flags and generation state to Kestrel's; model.py is the model class
TGW drives (KestrelTGWModel); glue.py is what the hooks in TGW call; edits.py and
installer.py put those hooks into a TGW tree and take them out again. The installer side
(names.py, edits.py, installer.py, __main__.py) imports no engine, torch or triton.
"""
