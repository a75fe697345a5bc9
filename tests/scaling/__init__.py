"""Tests of the loss scaler (:mod:`lightning_mp.scaler`) and its parts (:mod:`lightning_mp.scaling`)."""
