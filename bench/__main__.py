from bench.publish import main

main()
