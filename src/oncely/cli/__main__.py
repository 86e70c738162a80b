from oncely.cli import main

main()
