"""Kestrel's console scripts (pyproject.toml [project.scripts]): `kestrel-ui`, `kestrel-api`
and `kestrel-convert` start the front ends of a checkout; `kestrel` (loader/__main__.py) and
`kestrel-tgw` (loader/tgw/__main__.py) point into the engine's packages directly."""
