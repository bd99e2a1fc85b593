"""Beyond what ran here: the scaling model and its cross-check, one real rank alone
(`parabench ranks`), the prediction at a world size (`parabench plan`), one rank on
fake tensors and the advice it prices (`parabench advise`), and the published runs
they meet."""
