"""Image inputs: decoding with bounds checked before pixels are paid for (decode.py), and the model's own
image processor settings applied as transformers applies them (preprocess.py). PIL and numpy only: the
front ends run this, and they load no torch."""
