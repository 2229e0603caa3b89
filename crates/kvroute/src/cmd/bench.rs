//! `kvroute bench`: the workload runner of `kvroute-bench`.

use std::process::ExitCode;

pub(crate) fn run(args: &kvroute_bench::BenchArgs) -> anyhow::Result<ExitCode> {
    let report = kvroute_bench::bench(args)?;
    #[allow(clippy::print_stdout)]
    {
        println!("report: {}", report.display());
    }
    Ok(ExitCode::SUCCESS)
}
