# sfujim/TD3, vendored (see each file's header).
