// Translation unit that builds the shared precompiled header (<torch/torch.h>, fmt).
