"""Every drafter of the house, one line each (drafters.py), and what derives from that list: the
names the commands take, train.py's stages, one loader for every drafter, its serving rule; and
the start-up profiles that ready the drafters weighing seconds on the device in use."""
