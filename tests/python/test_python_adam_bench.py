"""bench/python_adam.py end to end on a small case: its JSON carries the
configuration and every implementation's figures, and with --bench the same
case through strata-bench adam before and after strata's steps."""

import json
import os
import statistics
import subprocess
import sys
import unittest

try:
    import torch  # noqa: F401  (the script imports it)
except ImportError:  # pragma: no cover - python3-torch is a test package
    torch = None

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "bench", "python_adam.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args],
                          capture_output=True, text=True, timeout=240)


@unittest.skipIf(torch is None, "needs torch")
class PythonAdamBenchTest(unittest.TestCase):
    def test_json_with_the_bench_pair(self):
        bench = os.environ.get("STRATA_BENCH")
        if not bench:
            self.skipTest("STRATA_BENCH (a strata-bench binary) is not set")
        r = run("--params", "64K", "--tensors", "3", "--steps", "2",
                "--threads", "1", "--impls", "strata,torch_foreach",
                "--bench", bench)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = json.loads(r.stdout)
        config = out["config"]
        self.assertEqual(config["params"], 65536)
        self.assertEqual(config["tensors"], 3)
        self.assertEqual(config["strata_threads"], 1)
        results = out["results"]
        self.assertEqual(len(results["strata"]["times_s"]), 2)
        self.assertGreater(results["strata"]["params_per_s"], 0)
        foreach = results["torch_foreach"]
        self.assertGreater(foreach["strata_speedup"], 0)
        # One ratio per round: torch's step over strata's of the same round.
        rounds = [t / s for t, s in zip(foreach["times_s"],
                                        results["strata"]["times_s"])]
        self.assertEqual(foreach["strata_speedup_per_round"], rounds)
        self.assertAlmostEqual(foreach["strata_speedup_median"],
                               statistics.median(rounds))
        pair = results["strata_bench"]
        self.assertEqual(len(pair["params_per_s"]), 2)
        self.assertTrue(all(x > 0 for x in pair["params_per_s"]))
        args = pair["args"]
        self.assertEqual(args[args.index("--params") + 1], "65536")
        self.assertEqual(args[args.index("--threads") + 1], "1")
        self.assertEqual(args[args.index("--variants") + 1],
                         config["strata_variant"])
        self.assertAlmostEqual(
            pair["strata_ratio"],
            results["strata"]["params_per_s"] / max(pair["params_per_s"]))

    def test_bad_options_are_usage_errors(self):
        r = run("--params", "1K", "--impls", "strata", "--bench",
                "/nonexistent/strata-bench")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--bench: '/nonexistent/strata-bench' is not an "
                      "executable file", r.stderr)
        r = run("--params", "4", "--tensors", "5")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--tensors must be in [1, --params]", r.stderr)
        r = run("--params", "1K", "--impls", "strata,sgd")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--impls: unknown ['sgd']", r.stderr)
        r = run("--params", "1K", "--steps", "0")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--steps: 0 is out of range; accepted [1, 1000]",
                      r.stderr)
        r = run("--params", "1K", "--settle", "-1")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--settle: -1.0 is out of range", r.stderr)
        r = run("--params", "1K", "--impls", "torch_foreach", "--bench",
                sys.executable)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--bench: pairs strata's steps with strata-bench",
                      r.stderr)

    def test_a_failing_bench_is_named(self):
        # An executable that is not strata-bench: its failure and message
        # come back, not a traceback.
        r = run("--params", "1K", "--steps", "1", "--settle", "0",
                "--impls", "strata", "--bench", "/bin/false")
        self.assertEqual(r.returncode, 1)
        self.assertIn("--bench: strata-bench adam exited 1", r.stderr)
        self.assertNotIn("Traceback", r.stderr)


if __name__ == "__main__":
    unittest.main()
