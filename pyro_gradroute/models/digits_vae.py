"""Re-export of :mod:`pyro_gradroute.app.models.digits_vae` (its old location)."""

from ..app.models.digits_vae import VAE, load_binarized_digits, mlp, problem

__all__ = ["VAE", "load_binarized_digits", "mlp", "problem"]
