# bot66/MNISTDiffusion, vendored (see each file's header).
