"""The devices and links advise and the plan price: accelerator profiles and fabrics.
Torch-free."""
