"""TGW's `modules` package names, served by Kestrel's webui (see ../README.md)."""
