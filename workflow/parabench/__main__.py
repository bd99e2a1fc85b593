from parabench.cli import entry

entry()
