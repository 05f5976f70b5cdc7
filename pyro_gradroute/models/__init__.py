"""Old location of the bundled problems, kept for scripts that import
``pyro_gradroute.models.digits_vae``: the problems live in :mod:`pyro_gradroute.app.models`."""
