"""Installs flashnext's e2e shims in every Python process that has this directory on PYTHONPATH.

Python imports ``sitecustomize`` at start-up when it is on ``sys.path``; vLLM's API server, its
engine core and its TP workers inherit PYTHONPATH, so each of them gets the shims. Nothing here
touches an installed file: the shims act through import hooks (see flashnext_e2e_shims).
"""

import flashnext_e2e_shims

flashnext_e2e_shims.install()
