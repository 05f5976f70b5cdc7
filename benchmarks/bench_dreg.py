"""TraceDReG_ELBO vs RenyiELBO(alpha=0) (IWAE): guide-gradient SNR over K, time and memory.

Run: ``python benchmarks/bench_dreg.py`` (``--quick`` for a short, noisier run).

(1) Signal-to-noise ratio |mean| / std of the guide gradient over repeated draws, on the
Gaussian model of Rainforth et al. (2018): ``z ~ N(mu, I)``, ``x | z ~ N(z, I)``,
``q(z | x) = N(A x + b, 2/3 I)``, ``D = 20``, parameters at the optimum perturbed by
``N(0, 0.01^2)``. Reported: the median over the guide's parameter coordinates, for
K in 1, 10, 100, 1000. IWAE's falls with K, DReG's rises; and the same for the Renyi
bounds ``alpha`` in {-0.5, 0.2, 0.5, 0.9} (``RenyiELBO(alpha)`` vs ``TraceDReG_ELBO(alpha)``).
(2) time per SVI step and saved-for-backward memory of DReG over IWAE with the same K on
the digits VAE, measured side by side (interleaved) in one process, one thread.
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import torch
from _common import (
    add_results_argument,
    print_table,
    recording,
    saved_tensor_bytes,
    time_interleaved,
)
from pyro.infer import SVI, RenyiELBO

from pyro_gradroute.app.models.digits_vae import VAE, load_binarized_digits
from pyro_gradroute.infer import TraceDReG_ELBO

D = 20


def gaussian_snr(Ks, draws, seed=0, chunk=1000, perturbation=0.01, alpha=0.0):
    """Median over coordinates of |mean| / std of the guide gradient, per K and estimator.

    ``draws`` independent gradient estimates come from one backward per ``chunk``: the
    model and guide are replicated in a plate of ``chunk`` independent copies, each with
    its own copy of the guide parameters (identical values), so the gradient with respect
    to copy ``r``'s parameters is the ``r``-th independent estimate.
    """
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(D, generator=g)
    x = mu + torch.randn(D, generator=g) * 2**0.5  # x ~ p(x) = N(mu, 2I)
    A0 = torch.eye(D) / 2 + perturbation * torch.randn(D, D, generator=g)
    b0 = mu / 2 + perturbation * torch.randn(D, generator=g)

    def model(R):
        with pyro.plate("copies", R):
            z = pyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=x.expand(R, D))

    def guide(R):
        A = pyro.param("A", A0.expand(R, D, D).clone())
        b = pyro.param("b", b0.expand(R, D).clone())
        with pyro.plate("copies", R):
            pyro.sample("z", dist.Normal((A @ x) + b, (2 / 3) ** 0.5).to_event(1))

    rows = []
    for K in Ks:
        snr = {}
        for name, elbo in (
            (
                "IWAE",
                RenyiELBO(
                    alpha=alpha, num_particles=K, vectorize_particles=True, max_plate_nesting=1
                ),
            ),
            ("DReG", TraceDReG_ELBO(num_particles=K, alpha=alpha, max_plate_nesting=1)),
        ):
            gs = []
            for _ in range(max(1, draws // chunk)):
                pyro.clear_param_store()
                guide(chunk)
                ps = [pyro.param(k).unconstrained() for k in ("A", "b")]
                elbo.loss_and_grads(model, guide, chunk)
                gs.append(torch.cat([p.grad.reshape(chunk, -1) for p in ps], dim=1))
            gs = torch.cat(gs)
            snr[name] = (gs.mean(0).abs() / gs.std(0)).median().item()
        rows.append((K, f"{snr['IWAE']:.4f}", f"{snr['DReG']:.4f}"))
    return rows


def vae_cost(K, batch_size, rounds):
    train, _ = load_binarized_digits()
    batch = train[:batch_size]
    steps = {}
    pyro.clear_param_store()
    vae = VAE()  # one network: both estimators step the parameters the param store holds
    for name, elbo in (
        (
            "IWAE",
            RenyiELBO(alpha=0, num_particles=K, vectorize_particles=True, max_plate_nesting=1),
        ),
        ("DReG", TraceDReG_ELBO(num_particles=K, max_plate_nesting=1)),
    ):
        svi = SVI(vae.model, vae.guide, pyro.optim.Adam({"lr": 1e-3}), elbo)
        steps[name] = lambda svi=svi: svi.step(batch)
    t = time_interleaved(steps, rounds)
    m = {k: saved_tensor_bytes(f) for k, f in steps.items()}
    return t, m


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cost-only", action="store_true", help="only the step-time table")
    add_results_argument(parser)
    args = parser.parse_args(argv)
    with recording(args.results, argv):
        torch.set_num_threads(1)
        pyro.set_rng_seed(0)
        if args.cost_only:
            return cost_table(args)
        draws = 2000 if args.quick else 20000
        title = (
            "Guide-gradient SNR (median over coordinates), Gaussian model D=20 "
            f"({draws} independent gradient draws per cell; the SNR estimate's noise floor "
            f"is ~{(2 / 3.1416 / draws) ** 0.5:.3f})"
        )
        rows = gaussian_snr([1, 10, 100, 1000], draws)
        print_table(rows, ("K", "IWAE SNR", "DReG SNR"), title)
        print()
        rows = []
        for alpha in (-0.5, 0.2, 0.5, 0.9):
            for K, iw, dr in gaussian_snr([10, 100], draws // 4, alpha=alpha):
                rows.append((alpha, K, iw, dr))
        title = "Renyi bounds: RenyiELBO(alpha) vs TraceDReG_ELBO(alpha), same model, guide SNR"
        print_table(rows, ("alpha", "K", "Renyi SNR", "DReG SNR"), title)
        print()
        cost_table(args)


def cost_table(args):
    rows = []
    for K in (16, 64):
        t, m = vae_cost(K, 64, 20 if args.quick else 100)
        rows.append(
            (
                K,
                f"{1e3 * t['IWAE']:.1f}",
                f"{1e3 * t['DReG']:.1f}",
                f"{t['DReG'] / t['IWAE']:.3f}",
                f"{m['DReG'] / m['IWAE']:.3f}",
            )
        )
    title = (
        "DReG over RenyiELBO(alpha=0), digits VAE, batch 64 (targets: time <= 1.05, memory <= 1.02)"
    )
    print_table(rows, ("K", "IWAE ms/step", "DReG ms/step", "time ratio", "memory ratio"), title)


if __name__ == "__main__":
    main()
