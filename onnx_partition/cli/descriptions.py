"""Each verb's description in its ``--help`` (the text above its options)."""

from __future__ import annotations

__all__ = ["DESCRIPTIONS"]

DESCRIPTIONS = {
    "export": "Build a model recipe from code (random weights, nothing downloaded) and write "
              "OUTPUT (ONNX) and, beside it, its training program (OUTPUT with suffix .pt2), "
              "which `partition --mode train` and `train` need.",
    "profile": "Read an ONNX model, time every operator on a device with onnxruntime, and "
               "write the per-node times to OUTPUT (costs.json, for partition --costs). With "
               "--plan PLAN: read a plan folder, time its stages alone and side by side, and "
               "write the plan calibrated (re-cut if that moves the optimum) in place or to "
               "OUTPUT. --mode train loads the model's program MODEL.pt2, which is code "
               "(torch.export.load unpickles it): profile only models you trust; its path and "
               "sha256 are printed first.",
    "partition": "Read an ONNX model (and a costs.json or the analytic cost model; for "
                 "--mode train the model's program MODEL.pt2 beside it) and write a plan "
                 "folder: one ONNX file per stage, plan.json and a manifest. Prints the "
                 "stage table.",
    "run": "Read a plan folder and run it as a pipeline (threads, or one process per stage "
           "replica with --nproc) on random inputs or --input files; prints measured against "
           "predicted figures (--json: one JSON object). Writes nothing.",
    "train": "Read a train-mode plan folder (partition --mode train) and the model's program "
             "(MODEL.pt2) and train it, one process per stage replica, on --data (a .npz or a "
             "folder of .npy: the model's inputs plus labels) with --loss (auto: the model's own "
             "scalar output, cross-entropy for integer labels, else mean squared error); "
             "without --data, on synthetic batches (random inputs from the plan's input specs, "
             "--seed) with a synthetic loss. Prints a line per step (--json: one JSON object); "
             "writes checkpoints with --checkpoint-dir, a per-step log with --log, the trained "
             "weights as a new plan folder with --save, measured stage times with --record. "
             "The program MODEL.pt2 is code (torch.export.load unpickles it): train only plans "
             "you trust; its path and sha256 are printed first, and it loads only from in or "
             "beside the plan folder or beside the plan's model. Checkpoints (safetensors + "
             "JSON), --data (.npz/.npy, no pickles) and plan.json are read as data only.",
    "simulate": "Read a plan folder and simulate its schedule: prints the iteration time, "
                "bubbles, memory and samples/s (--json: one JSON object). Writes nothing.",
    "report": "Read a plan folder (and the model beside it, for the operator graph) and write "
              "one self-contained HTML page: PLAN.report.html beside the folder, or -o.",
    "demo": "Export a recipe, time its nodes on this CPU (profile), partition it on those "
            "times into one stage per CPU, time the plan's stages in the pipeline (profile "
            "--plan) and run it with --check; writes the model, costs.json and the plan "
            "folder in a temporary folder, removed at the end, or in --workdir, which keeps "
            "them.",
}
