"The temporary files that killed `save_atomic` calls leave are removed by the next save into that folder, whatever name they were for; a live process's are kept."
import os, subprocess, sys
import torch
from mpcallbacks.test_utils import synth_learner

def test_temporary_files_of_killed_saves_of_any_name_are_removed_by_the_next_save_into_the_folder(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    (tmp_path/'models').mkdir()
    p = subprocess.Popen([sys.executable, '-c', 'pass']); p.wait() # a pid that no longer runs
    for name in ('epoch_3.pth', 'best.model.pth'): (tmp_path/'models'/f'.{name}.{p.pid}.tmp').write_bytes(b'half a checkpoint')
    (tmp_path/'models'/f'.other.pth.{os.getpid()}.tmp').write_bytes(b'a save still running') # a live process's: kept
    learn.save_atomic('ck', with_opt=False)
    assert sorted(os.listdir(tmp_path/'models')) == [f'.other.pth.{os.getpid()}.tmp', 'ck.pth']
