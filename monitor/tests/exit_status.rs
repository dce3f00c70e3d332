//! The `vgpu-smi` binary's exit statuses, as `--help` documents them: 0 done (help and version
//! too), 1 a region that cannot be read, 2 a bad command line, with one error naming the argument.

use std::process::{Command, Output};

fn vgpu_smi(arguments: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vgpu-smi"))
        .args(arguments)
        .env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE")
        .output()
        .expect("run vgpu-smi")
}

#[test]
fn help_and_version_succeed_on_stdout() {
    for arguments in [
        &["--help"][..],
        &["-h"],
        &["help"],
        &["help", "serve"],
        &["plot", "--help"],
        &["--version"],
    ] {
        let output = vgpu_smi(arguments);
        assert_eq!(output.status.code(), Some(0), "{arguments:?}");
        assert!(!output.stdout.is_empty() && output.stderr.is_empty(), "{arguments:?}");
    }
    let version = String::from_utf8_lossy(&vgpu_smi(&["--version"]).stdout).into_owned();
    assert!(
        version.starts_with(&format!("vgpu-smi {}\n", env!("CARGO_PKG_VERSION"))),
        "{version}"
    );
    assert!(
        version.contains("region layout: HAMi-core 1.2 with vgpu extension 2"),
        "{version}"
    );
}

#[test]
fn a_bad_command_line_is_status_2_naming_the_argument() {
    for (arguments, named) in [
        (&["--frobnicate"][..], "--frobnicate"),
        (&["frobnicate"], "frobnicate"),
        (&["suspend", "--pid", "-3"], "--pid"),
        (&["--watch", "soon"], "--watch"),
        (&["serve"], "--listen"),
    ] {
        let output = vgpu_smi(arguments);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{arguments:?}: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(named),
            "{arguments:?}: {stderr}"
        );
        assert!(output.stdout.is_empty(), "{arguments:?}");
    }
}

#[test]
fn an_unreadable_region_is_status_1() {
    let output = vgpu_smi(&["--region", "/nonexistent/vgpu-region"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stdout).contains("/nonexistent/vgpu-region"));
}

/// An address that cannot be listened on ends `serve` at once with status 1 and one line.
#[test]
fn serve_on_a_taken_address_is_status_1_in_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let address = taken.local_addr().expect("its address").to_string();
    for listen in [address.as_str(), "not-an-address"] {
        let output = vgpu_smi(&["serve", "--listen", listen]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{listen}: {stderr}");
        assert!(
            stderr.starts_with(&format!("vgpu-smi: cannot listen on {listen}: ")) && stderr.lines().count() == 1,
            "{listen}: {stderr}"
        );
    }
}
