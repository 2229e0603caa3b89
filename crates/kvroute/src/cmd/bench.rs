//! `kvroute bench`: the workload runner of `kvroute-bench`.

use std::process::ExitCode;

pub(crate) fn run(args: &kvroute_bench::BenchArgs) -> anyhow::Result<ExitCode> {
    let finished = kvroute_bench::bench(args)?;
    #[allow(clippy::print_stdout)]
    {
        print!("{}", finished.summary);
        println!("\nreport: {}", finished.report.display());
    }
    Ok(ExitCode::SUCCESS)
}
