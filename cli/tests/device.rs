//! `--device`: a GPU that this build or this machine cannot give fails start-up with a message
//! naming the device, and an exit status of 1, never a panic; before anything listens. And
//! `device-check`, run on the CPU: the device path against the CPU kernels.

use std::process::Command;

/// Runs `swarmgate ARGS` and returns its exit code, standard output and standard error.
fn run_with_output(args: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_swarmgate"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("the binary runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Runs `swarmgate ARGS` and returns its exit code and standard error.
fn run(args: &[&str]) -> (Option<i32>, String) {
    let (code, _, stderr) = run_with_output(args);
    (code, stderr)
}

/// The device path on the CPU (f32 weights and activations, the cache as tensors, the decode
/// kernel's CPU twin) agrees with the CPU kernels (8-bit activations, as llama.cpp) as
/// `device-check` requires, and the report says so with its figures.
#[test]
fn the_device_path_on_the_cpu_passes_the_device_check() {
    let (code, stdout, stderr) = run_with_output(&[
        "device-check",
        "--device",
        "cpu",
        "--prompts",
        "3",
        "--tokens",
        "10",
    ]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON object");
    assert_eq!(report["pass"], true, "{report}");
    assert_eq!(report["device"], "cpu");
    assert_eq!(report["prompts"], 3);
    let figure = |name: &str| {
        report[name]
            .as_f64()
            .unwrap_or_else(|| panic!("{name}: {report}"))
    };
    // The kernel and candle's operations differ by summation order only.
    assert!(figure("kernel_vs_ops_max_logit_diff") < 1e-3, "{report}");
    for name in ["max_logit_diff", "decode_max_logit_diff"] {
        assert!(figure(name) <= figure("tolerance"), "{name}: {report}");
    }
    // A batch against each prompt alone: the same products, so only summation order.
    assert!(figure("batch_max_logit_diff") <= 0.01, "{report}");
    for name in ["top1_agreement", "decode_top1_agreement"] {
        assert!(figure(name) >= 0.9, "{name}: {report}");
    }
}

#[test]
fn a_gpu_that_cannot_be_had_fails_start_up_naming_it() {
    for (args, named) in [
        (
            &[
                "serve",
                "--port",
                "0",
                "--grpc-port",
                "0",
                "--device",
                "cuda:0",
            ][..],
            "cuda:0",
        ),
        (
            &["worker", "--port", "0", "--device", "cuda:3"][..],
            "cuda:3",
        ),
        (
            &["generate", "--prompt", "Hi", "--device", "cuda"][..],
            "cuda:0",
        ),
        (
            &[
                "serve",
                "--port",
                "0",
                "--grpc-port",
                "0",
                "--embedding-device",
                "cuda:1",
            ][..],
            "cuda:1",
        ),
        (
            &["bench", "--concurrency", "1", "--device", "cuda:2"][..],
            "cuda:2",
        ),
    ] {
        let (code, stderr) = run(args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?} names {named}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    let (code, stderr) = run(&["serve", "--device", "gpu0"]);
    assert_eq!(
        code,
        Some(2),
        "a device that does not parse is a usage error: {stderr}"
    );
    assert!(stderr.contains("cuda:N"), "{stderr}");
}
