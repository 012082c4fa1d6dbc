"""`python -m nanotron.train` and `torchrun -m nanotron.train`: the training command (`nanotron.commands.train`)
under the module name that launchers start on every rank."""

from nanotron.commands.train import main
from nanotron.errors import run_as_main

if __name__ == "__main__":
    run_as_main(main)
