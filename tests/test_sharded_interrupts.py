"A Ctrl-C while a sharded fit shards the model: the sharding completes (the optimizer is the shards'), then the Ctrl-C is raised"
import subprocess, sys, textwrap
import pytest, torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason='no torch.distributed')

SCRIPT = textwrap.dedent("""
    import os, warnings
    warnings.simplefilter('ignore')
    import torch
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ.get('PORT', '29531'))
    torch.distributed.init_process_group('gloo', rank=0, world_size=1)
    import mpcallbacks.all, mpcallbacks.sharded as sh
    from mpcallbacks.test_utils import synth_learner
    learn = synth_learner().to_mixed(torch.float16)
    learn.fit(1, 1e-3) # (an optimizer with state, to carry over to the shards)
    learn.to_sharded()
    real, calls = sh.load_sharded_opt, []
    def interrupted(*args):
        calls.append(1)
        if len(calls) == 1: raise KeyboardInterrupt('injected') # (the first time: as the shards' optimizer is loaded)
        return real(*args)
    sh.load_sharded_opt = interrupted
    try: learn.fit(1, 1e-3)
    except KeyboardInterrupt: print('interrupted')
    ps = {id(p) for p in learn.model.parameters()}
    print('opt on shards', all(id(p) in ps for pg in learn.opt.param_lists for p in pg))
    print('state', all(len(learn.opt.state[p]) > 0 for pg in learn.opt.param_lists for p in pg if p.requires_grad))
    learn.fit(1, 1e-3) # (and the next fit trains)
    print('next fit', learn.recorder.values[-1][0] == learn.recorder.values[-1][0])
    torch.distributed.destroy_process_group()
""")

@pytest.mark.cpu_rules() # (a process of its own)
def test_a_ctrl_c_while_sharding_leaves_the_optimizer_on_the_shards(tmp_path):
    out = subprocess.run([sys.executable, '-c', SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**__import__('os').environ, 'PORT': str(29600 + __import__('os').getpid() % 300)})
    assert out.stdout.split('\n')[:4] == ['interrupted', 'opt on shards True', 'state True', 'next fit True'], out.stdout + out.stderr[-3000:]
