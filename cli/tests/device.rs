//! `--device`: a GPU that this build or this machine cannot give fails start-up with a message
//! naming the device, and an exit status of 1, never a panic; before anything listens.

use std::process::Command;

/// Runs `swarmgate ARGS` and returns its exit code and standard error.
fn run(args: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_swarmgate"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("the binary runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
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
