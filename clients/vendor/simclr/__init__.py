# sthalles/SimCLR, vendored (see each file's header).
