"""Tests of the step engines (:mod:`lightning_mp.engine`): the Trainer's automatic and manual steps and Fabric's."""
